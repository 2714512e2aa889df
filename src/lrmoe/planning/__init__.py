"""Planning of one layer: placement, assignment of pairs to copies, quotas, the controller, cap fitting."""
