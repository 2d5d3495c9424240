"""Plain-torch transformer definitions. Nothing here knows about graphs or Ray."""
