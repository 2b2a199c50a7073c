"""A trained checkpoint, without Lightning: engines.py and ct2_worker.py decode it, grid.py and tuned.py are make tune,
protocol.py is the end of a run."""
