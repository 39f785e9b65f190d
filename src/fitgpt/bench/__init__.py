"""Benchmarking: policies measured side by side on real steps (`run`), and shown (`report`).

Measures; the planner's prediction for each policy stands beside the measurement (`fitgpt.plan`)."""
