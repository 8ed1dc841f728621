"""What several test modules share, imported as ``support.NAME`` (tests/ is on the path,
tests/conftest.py): the error catalogue's texts (catalogue), trainer runs and their
folders (train_runs), checkpoint runs and damaged checkpoint directories
(checkpoint_runs, checkpoint_dirs, and checkpoint_saver, the process the kill -9 trials
stop), Hugging Face folders (hf_folders), quantized-weight subclasses
(quantized_weights), the whole-matrix optimizer's test model (whole_matrix_runs), the
small GPT sharded per layer that the core's tests step (small_gpt) and the errors of
ranks that failed on purpose (rank_failures). Test modules never import each other."""
