"""The push router: OpenAI-compatible front end that sends both legs at once."""
