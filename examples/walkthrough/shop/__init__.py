"""The walkthrough's shop: an async FastAPI service with SQLAlchemy and Alembic (docs/walkthrough.md)."""
