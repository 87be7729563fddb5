"""The engine: AsyncEngine (the step loop in the caller's event loop), EngineCore (schedule, execute, process) and their bookkeeping."""
