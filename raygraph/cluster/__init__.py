"""The coordinator actor, its scheduler, and worker start-up on a placement group."""
