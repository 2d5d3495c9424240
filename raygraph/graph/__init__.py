"""Step execution: batching inputs, bucketing, capture and replay (eager is the reference)."""
