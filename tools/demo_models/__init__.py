"""What builds and trains the demo models in sample_data/ (python -m tools.demo_models.NAME).

build.py and build_vision.py write the random-weight models; lessons.py, train.py and
train_kernels.py train the demo pair. The random-weight builder itself ships
(batchrun/models/random_model.py): batchrun builds the demo model on first use without the repo.
"""
