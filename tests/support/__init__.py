"""What several test modules share, imported as ``support.NAME`` (tests/ is on the path,
tests/conftest.py): the error catalogue's texts (catalogue), trainer runs and their
folders (train_runs), checkpoint runs and damaged checkpoint directories
(checkpoint_runs, checkpoint_dirs, and checkpoint_saver, the process the kill -9 trials
stop), Hugging Face folders (hf_folders), quantized-weight subclasses
(quantized_weights) and the whole-matrix optimizer's test model (whole_matrix_runs).
Test modules never import each other."""
