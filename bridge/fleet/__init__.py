"""Starting and releasing rollout workers: provisioners (local processes, any cloud CLI by
command templates) and the reconciler that makes the fleet follow the activation decision."""
