"""What every launch needs from the process it runs in.

    device.py    device facts (capability, SM count), asked of the driver once per device
    settings.py  every FLASHTILE_* switch, read and checked in one place
    launch.py    direct kernel launches (Triton's per-call argument binding skipped)
    replay.py    launch plans: a repeated call replays its first run's buffers and launches
    stubs.py     launches that do nothing, for host-cost probes without a GPU
"""
