package throttle

// ProtocolVersion is the version of slotbook's wire protocol, described in
// docs/PROTOCOL.md and checked by the vectors in
// throttle/testdata/protocol_vectors.json: the key layout, the stored
// values, the clock, and the scripts' keys, arguments and replies, which
// processes in any language follow to share a quota.
//
// Version 1 (v0.1.0) named a limiter's further limits' keys after Go's
// time.Duration.String ("name:{subject}:24h0m0s"); version 2 names them
// after the period in whole milliseconds ("name:{subject}:86400000ms").
// Processes of different versions that share a Redis do not see each
// other's keys of those limits.
const ProtocolVersion = 2
