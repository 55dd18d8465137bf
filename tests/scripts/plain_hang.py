"""Rank script that never uses ft_launcher's API (no section, no heartbeat): it sleeps SECONDS
(a hang, as far as the launcher can tell), then exits 0.

    python plain_hang.py SECONDS
"""
import sys
import time

time.sleep(float(sys.argv[1]))
