"""Rank script: misuses sections (end one never opened, open one twice, use a name with no
timeout) and then works normally; prints MISUSE OK if nothing raised."""
import ft_launcher as ft

client = ft.RankMonitorClient()
client.init_workload_monitoring()
client.end_section("never")
with ft.section("step"):
    client.start_section("step")
    client.end_section("step")
with ft.section("unknown"):
    pass
for _ in range(5):
    with ft.section("step"):
        ft.heartbeat()
client.end_all_sections()
print("MISUSE OK", flush=True)
