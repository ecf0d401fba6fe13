"""Container images for the platform: the learner image (`rhizome image build`)."""
