"""The scheduler: queues, token budget, preemption, and the step's plan as plain data. Imports no torch."""
