"""Commands other than training: bench, export, eval, prepare_bert."""
