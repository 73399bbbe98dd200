package store

// FollowState reports the highest version the follow loop processed and
// whether no retirement waits in it, for tests.
func FollowState(s *Store) (seen uint64, idle bool) {
	return s.follow.seen.Load(), s.follow.idle.Load()
}
