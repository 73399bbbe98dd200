package fs

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/store"
)

// Extended attributes. The user.mooncake.* names are computed from the
// object (and .pin can be set), read by name and not listed (Listxattr);
// other user.*, trusted.* and security.* names are stored with the object
// (storedName: the kernel checks who may read and change the last two,
// as for any file system); system.* (ACLs) and security.capability are
// not supported.
const (
	xattrPrefix   = "user."
	xattrSize     = "user.mooncake.size"
	xattrVersion  = "user.mooncake.version"
	xattrLocation = "user.mooncake.location"
	xattrPin      = "user.mooncake.pin"
	xattrStatus   = ioctl.StatusXattr
	mooncakeNS    = "mooncake."
	maxXattrValue = 64 << 10
	// maxFileXattrs bounds the stored xattrs of one file, names and
	// values; past it setxattr fails with ENOSPC (as ext4 does when a
	// file's xattr block is full). The mount's metadata as a whole is
	// bounded by the store (store.Options.MetaLimit).
	maxFileXattrs = 128 << 10
	// maxXattrList is what listxattr(2) can return (the kernel's
	// XATTR_LIST_MAX): a file's names, each with its NUL, the pin's
	// included, stay within it, or nothing could list them (E2BIG).
	maxXattrList = 64 << 10
)

// storedMooncake are the user.mooncake.* names stored with the object like
// any user attribute: the tensor metadata of the Python helpers.
var storedMooncake = map[string]bool{"mooncake.dtype": true, "mooncake.shape": true,
	xattrMeta: true, store.XattrReplicas: true, store.XattrPlacement: true}

// Names of other namespaces stored in Object.Xattrs, where a user.*
// name is kept without its "user.": one byte that no user name starts
// with (a name is a C string: never NUL; these are control bytes a name
// could hold, so they are refused there) for the namespace, then the rest.
var storedNS = []nsTag{{"trusted.", 0x01}, {"security.", 0x02}}

type nsTag struct {
	prefix string
	tag    byte
}

// storedName is the Object.Xattrs key of attribute attr. A namespace
// with no name after it ("user.") is EINVAL, as tmpfs answers; one this
// file system does not keep (system.*, security.capability) EOPNOTSUPP.
func storedName(attr string) (string, syscall.Errno) {
	if name, ok := strings.CutPrefix(attr, xattrPrefix); ok {
		switch {
		case name == "":
			return "", syscall.EINVAL
		case slices.ContainsFunc(storedNS, func(ns nsTag) bool { return name[0] == ns.tag }):
			return "", syscall.EOPNOTSUPP // would read as another namespace's
		}
		return name, 0
	}
	if attr == "security.capability" {
		// go-fuse answers reads of it itself (IgnoreSecurityLabels, which
		// spares every write a GETXATTR), so a kept value would never be
		// seen: refused, as before (no file capabilities here).
		return "", syscall.EOPNOTSUPP
	}
	for _, ns := range storedNS {
		if rest, ok := strings.CutPrefix(attr, ns.prefix); ok {
			if rest == "" {
				return "", syscall.EINVAL
			}
			return string(ns.tag) + rest, 0
		}
	}
	return "", syscall.EOPNOTSUPP
}

// attrName is the attribute name of Object.Xattrs key name, and whether
// only a caller with CAP_SYS_ADMIN sees it listed (trusted.*, as tmpfs
// lists it).
func attrName(name string) (string, bool) {
	for _, ns := range storedNS {
		if rest, ok := strings.CutPrefix(name, string(ns.tag)); ok {
			return ns.prefix + rest, ns.prefix == "trusted."
		}
	}
	return xattrPrefix + name, false
}

// xattrMeta (user.mooncake.meta) is the meta of PUT_KEY and vector
// batches: at most ioctl.MaxMeta bytes.
const xattrMeta = "mooncake.meta"

// dropMeta is the SetXattrs of a commit that replaces the bytes the meta
// described.
var dropMeta = map[string][]byte{xattrMeta: nil}

// checkStored validates the stored user.mooncake.* values that mean
// something to the daemon: the placement choice (one this store can
// meet), the meta.
func checkStored(st *store.Store, name string, v []byte) error {
	switch name {
	case store.XattrReplicas, store.XattrPlacement:
		return st.CheckPlacement(name, string(v))
	case xattrMeta:
		if len(v) > ioctl.MaxMeta {
			return fmt.Errorf("meta of %d B, at most %d: %w", len(v), ioctl.MaxMeta, syscall.E2BIG)
		}
	}
	return nil
}

// listedBytes is the most Listxattr can answer for o: its stored names,
// and the pin's and the meta's (which a put may add), each with its NUL.
func listedBytes(o *store.Object) int {
	n := len(xattrPin) + 1
	if _, ok := o.Xattrs[xattrMeta]; !ok {
		n += len(xattrPrefix+xattrMeta) + 1
	}
	for k := range o.Xattrs {
		name, _ := attrName(k)
		n += len(name) + 1
	}
	return n
}

func location(o *store.Object) string {
	var b strings.Builder
	for i, r := range o.Replicas {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(r.Node)
		b.WriteByte(':')
		for j, e := range r.Extents {
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteString(e.String())
		}
	}
	return b.String()
}

func (n *node) xattrValue(ctx context.Context, attr string) ([]byte, error) {
	if attr == xattrStatus && n.IsRoot() {
		if n.fs.opts.Status != nil {
			return n.fs.opts.Status()
		}
		return []byte(fmt.Sprintf("%+v", n.fs.st.Stats())), nil
	}
	o, err := n.xattrObject(ctx)
	if err != nil {
		return nil, err
	}
	switch attr {
	case xattrSize:
		return []byte(strconv.FormatUint(n.sizeOf(o), 10)), nil
	case xattrVersion:
		return []byte(strconv.FormatUint(o.Version, 10)), nil
	case xattrLocation:
		return []byte(location(o)), nil
	case xattrPin:
		if o.Pinned {
			return []byte("1"), nil
		}
		return []byte("0"), nil
	}
	name, errno := storedName(attr)
	if errno == syscall.EINVAL {
		return nil, errno
	}
	if v, ok := o.Xattrs[name]; ok && errno == 0 {
		return v, nil
	}
	return nil, syscall.ENODATA // system.posix_acl_access too: no ACL
}

// xattrObject is the version whose attributes n's reads: the one its key
// holds while that is still n's inode (liveObject). Once n was unlinked
// or replaced (a rename over it: the kernel can still hold its dentry),
// what is known of it (namelessObject); else ErrStale, on
// which the kernel looks the path up again and asks what is there now,
// as for a stat; not ENOENT for a name that never stopped existing, nor
// the attributes of another file.
func (n *node) xattrObject(ctx context.Context) (*store.Object, error) {
	key, ok := n.key()
	o, err := n.liveObject(ctx, key, ok)
	if o != nil || err != nil {
		return o, err
	}
	if o := n.namelessObject(nil, !ok); o != nil {
		return o, nil
	}
	return nil, store.ErrStale
}

// Getxattr implements gofs.NodeGetxattrer.
func (n *node) Getxattr(ctx context.Context, attr string, dest []byte) (sz uint32, errno syscall.Errno) {
	errno = n.afterRenames(func() syscall.Errno { sz, errno = n.getxattr(ctx, attr, dest); return errno })
	return sz, errno
}

func (n *node) getxattr(ctx context.Context, attr string, dest []byte) (sz uint32, errno syscall.Errno) {
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, "getxattr", attr, 0, start, errno, err) }()
	v, err := n.xattrValue(ctx, attr)
	if err != nil {
		return 0, toErrno(err)
	}
	if len(dest) == 0 {
		return uint32(len(v)), 0
	}
	if len(dest) < len(v) {
		return uint32(len(v)), syscall.ERANGE
	}
	return uint32(copy(dest, v)), 0
}

// Setxattr implements gofs.NodeSetxattrer.
func (n *node) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	return n.afterRenames(func() syscall.Errno { return n.setxattr(ctx, attr, data, flags) })
}

func (n *node) setxattr(ctx context.Context, attr string, data []byte, flags uint32) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, "setxattr", attr, 0, start, errno, err) }()
	name, errno := storedName(attr)
	if errno != 0 {
		return errno
	}
	if len(data) > maxXattrValue || len(name) > store.MaxNameLen {
		return syscall.E2BIG
	}
	var change func(o *store.Object) error
	if name == "mooncake.pin" {
		var pin bool
		switch strings.TrimSpace(string(data)) {
		case "1", "true":
			pin = true
		case "0", "false":
		default:
			return syscall.EINVAL
		}
		change = func(o *store.Object) error {
			o.Pinned = pin
			return nil
		}
	} else {
		if strings.HasPrefix(name, mooncakeNS) && !storedMooncake[name] {
			// Computed attributes are read-only; unknown ones are reserved.
			return syscall.EPERM
		}
		if err = checkStored(n.fs.st, name, data); err != nil {
			return toErrno(err)
		}
		change = func(o *store.Object) error {
			_, exists := o.Xattrs[name]
			if flags&0x1 != 0 && exists { // XATTR_CREATE
				return store.ErrExists
			}
			if flags&0x2 != 0 && !exists { // XATTR_REPLACE
				return syscall.ENODATA
			}
			if o.Xattrs == nil {
				o.Xattrs = map[string][]byte{}
			}
			o.Xattrs[name] = append([]byte(nil), data...)
			if o.XattrBytes() > maxFileXattrs || !exists && listedBytes(o) > maxXattrList {
				return syscall.ENOSPC
			}
			return nil
		}
	}
	err = n.changeXattrs(ctx, name, change)
	return toErrno(err)
}

// changeXattrs makes change to the object of n, whose stored attribute
// name it sets or removes: to the version its key holds, or, once n has
// no name left (unlinked or renamed over while open), to the nameless
// file's attributes that its descriptors see, as on tmpfs
// (changeNameless).
func (n *node) changeXattrs(ctx context.Context, name string, change func(o *store.Object) error) error {
	key, ok := n.key()
	var err error
	if ok {
		_, err = n.fs.st.Update(ctx, key, n.StableAttr().Ino, change)
	} else {
		_, err = n.changeNameless(nil, change)
	}
	if err == nil && name == xattrMeta {
		n.metaGen.Add(1)
	}
	return err
}

// Removexattr implements gofs.NodeRemovexattrer.
func (n *node) Removexattr(ctx context.Context, attr string) syscall.Errno {
	return n.afterRenames(func() syscall.Errno { return n.removexattr(ctx, attr) })
}

func (n *node) removexattr(ctx context.Context, attr string) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, "removexattr", attr, 0, start, errno, err) }()
	name, errno := storedName(attr)
	if errno != 0 {
		return errno
	}
	if strings.HasPrefix(name, mooncakeNS) && !storedMooncake[name] {
		return syscall.EPERM
	}
	err = n.changeXattrs(ctx, name, func(o *store.Object) error {
		if _, ok := o.Xattrs[name]; !ok {
			return syscall.ENODATA
		}
		delete(o.Xattrs, name)
		return nil
	})
	return toErrno(err)
}

// Listxattr implements gofs.NodeListxattrer.
func (n *node) Listxattr(ctx context.Context, dest []byte) (sz uint32, errno syscall.Errno) {
	errno = n.afterRenames(func() syscall.Errno { sz, errno = n.listxattr(ctx, dest); return errno })
	return sz, errno
}

func (n *node) listxattr(ctx context.Context, dest []byte) (sz uint32, errno syscall.Errno) {
	// The computed names (size, version, location, the root's status)
	// are read by name, not listed: programs that copy a file's
	// attributes (cp -a, rsync -X, tar --xattrs) copy what is listed, and
	// would set them on the copy, which fails here (EPERM) and leaves
	// stale values elsewhere. The pin is listed while it is set, so such
	// a copy keeps it.
	var names []string
	if !n.IsRoot() {
		o, err := n.xattrObject(ctx)
		if err != nil {
			return 0, toErrno(err)
		}
		if o.Kind == store.KindFile && o.Pinned {
			names = append(names, xattrPin)
		}
		admin := -1 // whether the caller has CAP_SYS_ADMIN, asked once if needed
		for k := range o.Xattrs {
			name, privileged := attrName(k)
			if privileged && admin < 0 {
				admin = 0
				if c, ok := fuse.FromContext(ctx); ok && hasCapability(c.Pid, capSysAdmin) {
					admin = 1
				}
			}
			if !privileged || admin == 1 {
				names = append(names, name)
			}
		}
	}
	var buf []byte
	for _, s := range names {
		buf = append(buf, s...)
		buf = append(buf, 0)
	}
	if len(dest) == 0 {
		return uint32(len(buf)), 0
	}
	if len(dest) < len(buf) {
		return uint32(len(buf)), syscall.ERANGE
	}
	return uint32(copy(dest, buf)), 0
}
