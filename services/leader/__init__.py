"""Leader election between daemons: one holds a role, the others wait warm (hot standby)."""
