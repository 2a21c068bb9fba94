"""Alembic environment of the state store: runs on the connection that mortal.state.migrate hands it.

Never run from a command line with a URL of its own: `mortal.state.migrate` builds the Alembic
Config in code, opens the transaction, takes the migration lock and passes the connection here.
"""

from alembic import context
from sqlmodel import SQLModel

from mortal.state import tables  # noqa: F401  (registers the tables on SQLModel.metadata)
from mortal.state.migrate import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
