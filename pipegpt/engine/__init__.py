"""One rank's machinery, whatever role it serves (training today, inference next): its device and cores
(placement), the model stages of a plan with their point-to-point and runtime (engine), and what a rank
reports (results). Nothing is re-exported here: import the submodules."""
