"""Initial schema: fingerprints, tuning runs, measurements, profiles, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

KEY = (
    "fingerprint",
    "software",
    "transport_family",
    "ep_size",
    "nodes",
    "hidden",
    "intermediate",
    "experts",
    "topk",
    "dtype",
    "token_bucket",
)


def upgrade() -> None:
    op.create_table(
        "fingerprints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(128), nullable=False),
        sa.Column("facts", sa.JSON(), nullable=False),
        sa.Column("first_seen", sa.String(40), nullable=False),
        sa.Column("last_seen", sa.String(40), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_fingerprints"),
        sa.UniqueConstraint("hash", name="uq_fingerprints_hash"),
    )
    op.create_table(
        "tuning_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_name", sa.String(256), nullable=False),
        sa.Column("storage", sa.String(1024), nullable=False),
        sa.Column("backend", sa.String(128), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("trials", sa.Integer(), nullable=False),
        sa.Column("best_value", sa.Float(), nullable=True),
        sa.Column("started", sa.String(40), nullable=False),
        sa.Column("ended", sa.String(40), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_tuning_runs"),
    )
    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("transport", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("spread", sa.Float(), nullable=False),
        sa.Column("unit", sa.String(32), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.Column("created", sa.String(40), nullable=False),
        sa.ForeignKeyConstraint(
            ["fingerprint"],
            ["fingerprints.hash"],
            name="fk_measurements_fingerprint_fingerprints",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_measurements"),
    )
    op.create_index("ix_measurements_fingerprint", "measurements", ["fingerprint"])
    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(128), nullable=False),
        sa.Column("software", sa.String(128), nullable=False),
        sa.Column("transport_family", sa.String(64), nullable=False),
        sa.Column("ep_size", sa.Integer(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("hidden", sa.Integer(), nullable=False),
        sa.Column("intermediate", sa.Integer(), nullable=False),
        sa.Column("experts", sa.Integer(), nullable=False),
        sa.Column("topk", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("token_bucket", sa.Integer(), nullable=False),
        sa.Column("knobs", sa.JSON(), nullable=False),
        sa.Column("latency_us", sa.Float(), nullable=False),
        sa.Column("spread_us", sa.Float(), nullable=False),
        sa.Column("backend", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("software_versions", sa.JSON(), nullable=False),
        sa.Column("profile_hash", sa.String(32), nullable=False),
        sa.Column("created", sa.String(40), nullable=False),
        sa.Column("updated", sa.String(40), nullable=False),
        sa.CheckConstraint("status IN ('current', 'stale', 'superseded')", name="ck_profiles_status"),
        sa.CheckConstraint("latency_us >= 0 AND spread_us >= 0", name="ck_profiles_latency"),
        sa.ForeignKeyConstraint(
            ["fingerprint"],
            ["fingerprints.hash"],
            name="fk_profiles_fingerprint_fingerprints",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_profiles"),
    )
    # Two `current` profiles for one key are impossible.
    op.create_index(
        "uq_profiles_current_key",
        "profiles",
        list(KEY),
        unique=True,
        sqlite_where=sa.text("status = 'current'"),
        postgresql_where=sa.text("status = 'current'"),
    )
    op.create_index("ix_profiles_lookup", "profiles", ["fingerprint", "status"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created", sa.String(40), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(4096), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
    )
    op.create_index("ix_events_created", "events", ["created"])


def downgrade() -> None:
    op.drop_index("ix_events_created", table_name="events")
    op.drop_table("events")
    op.drop_index("ix_profiles_lookup", table_name="profiles")
    op.drop_index("uq_profiles_current_key", table_name="profiles")
    op.drop_table("profiles")
    op.drop_index("ix_measurements_fingerprint", table_name="measurements")
    op.drop_table("measurements")
    op.drop_table("tuning_runs")
    op.drop_table("fingerprints")
