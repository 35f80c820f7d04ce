"""What a run shows of itself: metrics and the run's files (metrics), plots, py-spy profiles, every rank's
clock on the driver's time line (clocks), and `pipegpt simulate`'s report (simulate_report). Import the submodules."""
