"""Inference with a trained student: side-by-side grids (`sample`), a pipeline folder (`export`), and
evaluation against the teacher's cached trajectories (`eval`)."""
