"""When things go wrong: rehearsed faults (faults), the stall watchdog (watchdog), device probes before a
restart (health), the layout for fewer ranks (elastic). Import the submodules."""
