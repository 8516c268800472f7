"""The server on a virtual clock: its own solver code over priced stand-in networks, and its clients (issue 51)."""
