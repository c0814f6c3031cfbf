"""The chaos suite (`make test-ha`): real processes on loopback, a private RabbitMQ cluster and a private
PostgreSQL the tests own; each case kills one server-side process mid-round and checks the job finishes with
nothing lost, nothing counted twice and no ε under-recorded, and reports how long the failover took."""
