"""What a run shows of itself: metrics and the run's files (metrics), plots, py-spy profiles, and every rank's
clock on the driver's time line (clocks). Import the submodules."""
