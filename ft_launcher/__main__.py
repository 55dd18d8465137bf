"""`python -m ft_launcher`: the same as the `ft_launcher` command."""
import sys

from ft_launcher.cli import main

sys.exit(main())
