"""A job as the data scientist writes it and every service reads it: the spec and its data section, the
model as data (layers and their shapes), the YAML text, and the checks a submission passes."""
