"""What lets a server-side part fail over to another process: leases with fencing terms in the coordinator's
database (`lease`)."""
