//! `stop_signals::claim` in a process of its own (it changes process-wide signal actions once).

/// What LLVM's handler does: put the default action back and raise the signal again (the process ends by it).
extern "C" fn foreign(sig: libc::c_int) {
    // SAFETY: signal() and raise() are async-signal-safe
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

fn current(sig: libc::c_int) -> libc::sighandler_t {
    // SAFETY: sigaction with a null new action only reads the current one
    let mut now: libc::sigaction = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::sigaction(sig, std::ptr::null(), &mut now) }, 0);
    now.sa_sigaction
}

#[tokio::test]
async fn an_inherited_handler_is_reset_and_tokio_listens() {
    let foreign = foreign as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that ends the process by the default action if it ever runs
    unsafe { libc::signal(libc::SIGTERM, foreign) };
    let reset = ft_server::stop_signals::claim();
    assert!(reset.contains(&"SIGTERM"), "{reset:?}");
    // tokio's handler holds SIGTERM now: neither the default action nor the foreign function
    let now = current(libc::SIGTERM);
    assert_ne!(now, libc::SIG_DFL);
    assert_ne!(now, foreign);
    // and a SIGTERM reaches a tokio listener without ending the process: tokio did not chain the foreign handler
    // (without claim's reset this test process dies by SIGTERM here)
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    // SAFETY: raises SIGTERM in this process; tokio's handler records it
    unsafe { libc::raise(libc::SIGTERM) };
    tokio::time::timeout(std::time::Duration::from_secs(5), term.recv()).await.expect("SIGTERM not delivered");
}
