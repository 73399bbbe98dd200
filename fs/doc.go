// Package fs serves the store as a FUSE file system (go-fuse, imported as
// gofs).
//
// # Concepts
//
// Keys are paths below the mount point. A node finds its key by walking its
// parents in go-fuse's inode tree, so a rename moves the node with no
// bookkeeping here; a node that can no longer reach the root was unlinked
// or replaced while open. Directories are explicit (mkdir) or implicit (the
// prefix of some key).
//
// A read-only handle holds a store.Reader: the version current at open,
// unchanged until release, whatever happens to the key meanwhile. Reads
// answer with a ReadResult whose Slices point into segment memory, so the
// daemon copies nothing; the result holds the version until go-fuse calls
// Done. Writable handles of one inode share one store.Draft (writes through
// different descriptors of one file see each other); close(2) (FLUSH) and
// fsync commit it atomically, so a reader never sees a partial write and a
// closed file is complete for everyone (close-to-open consistency).
//
// Files are opened with FOPEN_DIRECT_IO: the store is memory already, and a
// page cache would only hold a second copy. mmap still works through
// CAP_DIRECT_IO_ALLOW_MMAP.
//
// # Ioctls
//
// ioctl.go dispatches the ABI of package ioctl; dataio.go runs the data
// path (puts commit a new version through a store.Draft, gets read through
// a store.Reader, both moving bytes with one transfer.Engine request), with
// registered client buffers (register.go: pidfd_getfd + MAP_SHARED, owned by
// the open file), process memory (process_vm_*), and GPU memory (gpu.go:
// CUDA IPC handles opened once per daemon and context, ref-counted across
// open files). Batches on directories check mode bits themselves
// (access.go), since the kernel never looked those keys up.
//
// # Errors
//
// Every operation maps its error with toErrno (errno.go), the one place
// errno is made: a table walked with errors.Is, so wrapped errors map like
// their cause. Unknown errors become EIO and are logged. ENOSYS is never
// returned for a real error, because the kernel takes it as "not
// implemented" for flush, fsync and xattrs and stops calling them for the
// rest of the mount.
//
// Each operation ends with one debug log line (op, key, bytes, errno,
// latency) and a metrics observation.
//
// # Cluster mode
//
// With Options.Cluster (cluster.go) the kernel caches no attributes or
// negative entries, and every change the index watch reports invalidates
// the kernel's dentry, attributes and pages of that key; lookups answer
// from the store's index cache, which other nodes' commits reach before
// those commits return. Changing operations run detached from the request's cancellation:
// an interrupt does not cut a commit in half.
//
// # Lock order and deadlocks
//
// node.mu (the shared draft) before store locks; store locks are never
// held across a copy. The daemon must never do I/O on its own mount (a
// request would wait for itself); tests drive the mount from child
// processes. Commit happens in FLUSH, which runs while the closing process
// waits: it must not wait for anything that process holds.
package fs
