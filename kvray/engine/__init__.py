"""Engine: request lifecycle, the step loop and the offline ``LLM`` API."""
