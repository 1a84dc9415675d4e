"""Operations tooling around a kvray deployment, not inference: the ``kvray cluster`` checks of
``ray up`` configs and live clusters, and ``kvray grafana`` dashboard provisioning."""
