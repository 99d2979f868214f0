"""Run infrastructure, apart from the algorithm: paths and their checks, the run folder's lock, signal stops,
checkpoints, progress bars, the machine (CPU features, CUDA), memory plans, trackers, and the one-line error base."""
