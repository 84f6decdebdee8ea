"""ZoRRo (Zero Redundancy Rollouts) in training and log-probs: every shared prefix computed once."""
