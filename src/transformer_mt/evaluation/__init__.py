"""A trained checkpoint, without Lightning: decoders (engines, ct2_worker), make tune (grid, tuned), a run's end."""
