"""The worker's side of the step contract: plans in, sampled tokens out."""
