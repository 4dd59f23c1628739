"""Pipeline parallelism: a replica's model cut into stages, one per device of
the mesh's "stage" axis (`ReplicatorStrategy(pipeline=rs.Pipeline(...))`)."""
