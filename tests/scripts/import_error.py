"""A rank script that fails the same way in every rank and every cycle: a module it imports is
missing (as a typo in an import, or a package not installed on the nodes)."""
import ft_launcher_tests_no_such_module  # noqa: F401
