"""Draft heads on the target's own features: EAGLE-3 (``eagle3.py``) and Medusa (``medusa.py``) in their published
layouts, their trees (``trees.py``: EAGLE-2's dynamic trees, Medusa's static ones), the drafters the engine uses
(``drafter.py``) and EAGLE-3's training with the training-time test (``training.py``). Loading a head for a pair
(finding it, checking it fits the target) is ``backend/models/loading/head_loading.py``'s."""
