"""`tpurl plan`: memory and steps/hour of an RL run before renting the hardware (see docs/plan.md)."""
