"""A Flask application (Flask-SQLAlchemy) that emits in its requests; the relay runs as its own process.

    pip install 'sqlalchemy-outbox' flask flask-sqlalchemy
    export DATABASE_URL=sqlite:////tmp/flask_app.db          # or postgresql+psycopg://...
    outbox migrate --database-url "$DATABASE_URL"
    flask --app examples.flask_app run
    outbox-relay --app examples.flask_app:ob --database-url "$DATABASE_URL"     # a second terminal

The Outbox is installed on ``db.session``, Flask-SQLAlchemy's
``scoped_session``: that installs it on the session maker behind it, so every
request's session can emit. ``emit()`` wants the session itself,
``db.session()``, not the registry. The relay needs nothing from Flask: it
imports this module for ``ob`` (its routes) and connects with
``--database-url``. Each delivery appends a JSON line to the file named by
``DELIVERIES_FILE`` (default ``deliveries.jsonl``), standing in for an email.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox
from outbox import Message, Outbox, emit

DELIVERIES_FILE = Path(os.environ.get("DELIVERIES_FILE", "deliveries.jsonl"))


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)

ob = Outbox()
ob.install(db.session)  # a scoped_session: installs on its sessionmaker


class Signup(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "signups"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(255), unique=True)


@ob.handler("user.signed_up", name="welcome_email", max_attempts=5)
def send_welcome(msg: Message) -> None:
    with DELIVERIES_FILE.open("a") as out:
        out.write(json.dumps({"message_id": msg.id, "attempt": msg.attempt, **msg.payload}) + "\n")


def create_app(database_url: str | None = None, *, migrate: bool = True) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url or os.environ.get(
        "DATABASE_URL", "sqlite:///flask_app.db"
    )
    db.init_app(app)
    with app.app_context():
        outbox.enable_sqlite_savepoints(db.engine)  # transactional savepoints on SQLite; no-op elsewhere
        if migrate:  # what `outbox migrate` does; in production make it a deploy step
            outbox.upgrade(db.engine)
        db.create_all()

    @app.post("/signups")
    def sign_up() -> tuple[dict[str, object], int]:
        email = str((request.get_json(silent=True) or {}).get("email", ""))
        user = Signup(email=email)
        db.session.add(user)
        db.session.flush()  # the id, for the payload
        event_id = emit(
            db.session(), "user.signed_up", {"user_id": user.id, "email": email}, key=f"signup:{email}"
        )
        db.session.commit()  # the row and the event, together
        return {"id": user.id, "event_id": str(event_id)}, 201

    return app
