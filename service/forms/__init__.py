"""The request forms of `/prefill` and the region socket (the /v2 ones live in `kserve`): each
supplies the one pipeline (`pipeline.serve`) with how its request is read and answered
(`base.Form`), nothing more; the routes pick one and hand it to the pipeline."""
