"""The torch and numpy sides of a job's task (fedbroker.job.task): its per-sample loss (`losses`) and the sums a
site reports for federated evaluation and the scores made from them (`scores`)."""
