"""The engine: requests, scheduler, step executor and the step loop."""
