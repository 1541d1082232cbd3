"""zen-mla's HTTP service and command line; imports zen_mla, never the other way round."""
