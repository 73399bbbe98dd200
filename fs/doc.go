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
// Done.
//
// # Writing and publishing
//
// A writable handle opened with O_TRUNC writes a private draft: a new
// version of its own, so two processes rewriting one file at once each
// publish a whole file (the last to close wins), never a mix. Other
// writable handles of an inode share one store.Draft, so writes through
// different descriptors of one file see each other, as in-place updates
// and appends need; O_APPEND writes go to the draft's end, whatever size
// the kernel believed. A draft is published (committed atomically) by:
//
//   - fsync;
//   - close(2) by a process that wrote or ftruncated through that open
//     file, or by the process that opened it, from any of its threads
//     (closers.go: the kernel's lock owner names the descriptor table of
//     writer and closer);
//   - the last close of the open file (RELEASE), whatever is left.
//
// A close by a process that only inherited the descriptor (a child of
// fork, before or after exec) publishes nothing, so a helper run while a
// file is half written never shows the half. An O_TRUNC writer killed by a
// signal before it closed (the kernel closes its files as it dies, which
// /proc/TID/stat tells) publishes nothing either: its release discards the
// version, and the old one stays. A reader never sees a
// partial write; a closed file is complete for everyone (close-to-open
// consistency). A write or truncation that fails (ENOSPC) fails the
// draft: the closes report it and the previous version stays. While a
// file is written here, stat shows the size being written (the kernel
// keeps one size per inode and a writer's mmap and appends depend on it);
// readers read the last published version.
//
// # Stale nodes
//
// The kernel may send an operation for an inode it looked up before the
// file was removed, evicted or replaced. Opens and path-based getattr of
// such a node answer ESTALE, and the kernel looks the path up again
// (open, stat and the other path calls retry once), so an open reaches a
// live file or fails, never a draft that could only commit into nowhere.
// Never ENOENT: the kernel does not pass O_CREAT on to an OPEN, and the
// walk again creates the file for an open that has it. To keep such
// retries rare under churn (keys evicted and put anew all the time, where
// the one retry could land on a file evicted in turn), the kernel is told
// to forget a name once its file is evicted (evictnotes.go; a cluster's
// watch of the index does it there) and when a put by name makes its
// key anew under another inode (before the put replies).
// A file replaced by a rename through this mount keeps its last version
// as a ghost until the kernel forgets the inode: an open the kernel sends
// for it meanwhile gets that version, as on a local file system, so the
// write-temp-then-rename pattern never makes a reader fail.
//
// Files are opened with FOPEN_DIRECT_IO: the store is memory already, and a
// page cache would only hold a second copy. mmap still works through
// CAP_DIRECT_IO_ALLOW_MMAP.
//
// # Ioctls
//
// ioctl.go dispatches the ABI of package ioctl; dataio.go runs the data
// path of open files (puts commit a new version through a store.Draft,
// gets read through a store.Reader, both moving bytes with one
// transfer.Engine request), with registered client buffers (register.go:
// pidfd_getfd + MAP_SHARED, or an address range of the registering
// process, owned by the open file), process memory (process_vm_*), and GPU
// memory (gpu.go: CUDA IPC handles opened once per daemon and context,
// ref-counted, kept per client process by proc.go until it exits). Keys by
// name on directories (keyops.go: the batches, their vector forms and the
// one-key commands, all as keyOps of one or more segments) check mode bits
// themselves (access.go), since the kernel never looked those keys up. A
// table call (BATCH_PUT_TABLE) is a batch whose entries and keys the
// daemon reads from the caller's memory (through the transfer engine, by
// the caller's thread id, as process memory is) and writes back with
// their results: it checks it can write them before any key runs. A
// vector batch submitted with ioctl.VBatchAsync runs in a goroutine of its
// own and waits, results and all, in its directory handle's table
// (async.go) until BATCH_WAIT collects it. What it needs of its caller
// (groups, GPU mappings) is read at the submit, while the caller waits in
// the request; its keys are joined to the handle's directory's path when
// it runs. Unmounting waits for the ones still running, counted as
// running requests (a stuck one makes it give up, as a stuck ioctl does).
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
// # Limits
//
// Everything a user can make the daemon hold is bounded: open files and
// directories (Options.MaxOpen, a quarter of it for a user other than
// root, ENFILE; an open directory holds one page of its listing,
// Store.ListPage, not the directory), registered buffers
// per open file and per mount, by count and bytes (Options.MaxRegistrations
// and the others, EMFILE; a quarter of the mount's for a user other than
// root), xattrs per file (128 KiB, ENOSPC), and index
// metadata as a whole (store.Options.MetaLimit, ENOSPC unless eviction
// makes room). Only shmem and hugetlbfs memory can be registered: a file
// of a FUSE mount (this one above all) would make a copy wait on that
// mount's daemon.
//
// # Lock order and deadlocks
//
// node.mu (the node's drafts and ghost) before store locks; node.mu is
// never held across a commit (a stat answers while a close commits), and
// store locks are never held across a copy. A new writer of an inode
// waits for the last writer's release to finish publishing the shared
// draft. The daemon must never do I/O on its own mount (a
// request would wait for itself); tests drive the mount from child
// processes. Commit happens in FLUSH, which runs while the closing process
// waits: it must not wait for anything that process holds.
//
// Renames (renames.go): a rename holds FS.renaming shared and then its
// directories' dirLocks, the lower node ID's first; a lookup holds its
// directory's shared. A call that found its file gone from its name looks again with
// FS.renaming held (namesSettled), after any handle, node.rebaseMu or
// draft lock it holds, never after node.mu; nothing under it waits for a
// rename or a FUSE request.
package fs
