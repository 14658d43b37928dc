"""A team's own RL code, outside tpurl: a task class and reward functions named by import path."""
