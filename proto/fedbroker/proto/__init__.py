"""The wire contract: fedbroker.proto and the code protoc generates from it (`make proto`)."""
