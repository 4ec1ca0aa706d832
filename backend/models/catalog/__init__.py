"""The catalogue of model pairs: models.yaml read and validated (``config.py``, with ``config_fields.py``,
``config_head.py`` and the YAML reader ``config_yaml.py``), one model block's source and sizes (``model_spec.py``), and
adding a pair to the user's file (``user_pairs.py``)."""
