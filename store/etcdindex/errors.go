package etcdindex

import "errors"

// ErrCorrupt reports an index entry in etcd that this version cannot decode:
// an unknown format version, a malformed value, or a value outside the
// bounds in codec.go. It is never a panic and never a partial object.
var ErrCorrupt = errors.New("etcdindex: corrupt index entry")
